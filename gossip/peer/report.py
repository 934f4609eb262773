"""What a real peer reports: the JSON-lines metrics log and the final summary.

It owns the metrics file and reads the other parts (the peer's
:class:`~gossip.protocol.lifecycle.Lifecycle` and its transport); it changes none of them.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

from gossip.protocol.lifecycle import Lifecycle
from gossip.transport.zmq import ZmqTransport

__all__ = ["Reporter"]


def _jsonable(o: Any) -> Any:
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return str(o)


class Reporter:
    """Metrics records and the summary of one peer.

    ``life`` is the peer's :class:`~gossip.protocol.lifecycle.Lifecycle`, ``transport`` its
    transport (byte, drop and rejection counters), ``security`` and ``shaper``
    its CurveZMQ policy and link emulator, if any.
    """

    def __init__(self, life: Lifecycle, transport: ZmqTransport, *, security: Any = None, shaper: Any = None) -> None:
        self.life, self.transport, self.security, self.shaper = life, transport, security, shaper
        self.metrics: Any = None
        self.last_eval = 0
        self.every = 1

    def open(self, log: str | None, tensorboard: str | None) -> None:
        """Open the metrics log (JSON lines, and/or TensorBoard scalars)."""
        if log or tensorboard:
            from gossip.peer.tensorboard_log import open_metrics, run_name

            self.metrics = open_metrics(log, tensorboard and Path(tensorboard) / run_name(self.life.id))

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None

    def start_training(self, elapsed: float, evaluate: bool = True) -> None:
        """The starting point of every curve (``elapsed``: seconds since the peer started;
        ``evaluate=False``: the caller records its evaluations itself, a group's)."""
        node, cfg = self.life.node, self.life.cfg
        self.last_eval = node.step
        self.every = cfg.eval_every or max(1, cfg.steps // 10)
        if self.metrics is not None and evaluate:
            self.log_metrics("eval", time=elapsed)

    def after_step(self, elapsed: float) -> None:
        node = self.life.node
        if self.metrics is not None and node.step - self.last_eval >= self.every:
            self.last_eval = node.step
            self.log_metrics("eval", time=elapsed)

    def log_metrics(self, event: str, extra: dict | None = None, *, time: float = 0.0,
                    evaluation: dict[str, Any] | None = None) -> dict[str, Any]:
        """One metrics record; ``evaluation`` is the model's when the caller evaluated it (a
        group's whole model), else the task's evaluation of the node's own."""
        life = self.life
        node = life.node
        assert node is not None
        ev = evaluation if evaluation is not None else \
            life.task.evaluate(node.model, life.device) if life.task is not None else {}
        rec = {"event": event, "node": life.id, "time": time, "step": node.step,
               "round": node.round, "members": len(node.members), "train_loss": node.pop_mean_loss(), "loss": ev.get("loss"),
               "accuracy": ev.get("accuracy"), "neighbor_distance": node.neighbor_distance(),
               "bytes_sent": sum(self.transport.bytes_sent.values()),
               "bytes_received": sum(self.transport.bytes_received.values()), **(extra or {})}
        if "perplexity" in ev:
            rec["perplexity"] = ev["perplexity"]
        if self.metrics is not None:
            self.metrics.write(json.dumps(rec, default=_jsonable) + "\n")
            self.metrics.flush()
        return rec

    def summary(self, wall_time: float, evaluation: dict[str, Any] | None = None) -> dict[str, Any]:
        """The final figures (``gossip-node --json``); ``evaluation`` as for :meth:`log_metrics`."""
        life, transport = self.life, self.transport
        node, cfg = life.node, life.cfg
        sent, received = transport.bytes_sent, transport.bytes_received
        by_class: Counter[str] = Counter()
        with life.lock:  # members that said goodbye are gone from the table, not from the byte counts
            dcs = {**life.dcs, **{k: m.dc for k, m in life.membership.members.items()}}
        for peer, n in sent.items():
            by_class["inter" if dcs.get(peer, cfg.dc) != cfg.dc else "intra"] += n
        rejected = Counter(life.control.rejected)
        rejected.update(transport.rejected)
        if node is not None:
            rejected.update(node.rejected)
        out: dict[str, Any] = {"node": life.id, "steps": node.step if node else 0, "rounds": node.round if node else 0}
        if node is not None:
            ev = evaluation if evaluation is not None else \
                life.task.evaluate(node.model, life.device) if life.task is not None else {}
            out.update(final_loss=ev.get("loss"), final_accuracy=ev.get("accuracy"),
                       params_sha256=node.state.sha256(), neighbor_distance=node.neighbor_distance(),
                       missing_neighbors=node.mix_totals.missing, members=len(node.members))
            if "perplexity" in ev:
                out["final_perplexity"] = ev["perplexity"]
            report = node.rule.report()
            if "copies_sha" in report:  # indices -> member ids, comparable across nodes
                report["copies_sha"] = {node.members[j]: h for j, h in report["copies_sha"].items()
                                        if j < len(node.members)}
            out["mixing"] = report
        if self.shaper is not None:
            out["emulated_losses"] = transport.emulated_losses
        if self.security is not None:
            out["curve"] = self.security.report()
        out.update(bytes_sent=sum(sent.values()), bytes_received=sum(received.values()),
                   bytes_intra=by_class.get("intra", 0), bytes_inter=by_class.get("inter", 0),
                   dropped=sum(transport.dropped.values()),
                   rejected={k: v for k, v in sorted(rejected.items()) if v},
                   # control messages from senders that had not proved their address (first
                   # contacts: see gossip.protocol.control), which changed nothing
                   unproven=life.control.contacts.unproven,
                   # ROUTER connection events; a message above max_message_bytes is dropped by
                   # ZeroMQ, which closes the sender's connection: it shows up as "disconnected"
                   connections=dict(sorted(transport.events.items())),
                   max_message_bytes=transport.max_message_size, joined=life.joined, rejoins=life.rejoins,
                   merges=life.merges,
                   state_from=life.state_from, resumed_from=life.resumed_from, interrupted=life.interrupted,
                   device=str(life.device), wall_time_s=wall_time, start_wait_s=life.start_wait,
                   train_time_s=life.train_seconds,
                   max_step_gap_s=life.max_step_gap, timed_out_rounds=life.timed_out_rounds,
                   skipped_rounds=life.skipped_rounds,
                   recoveries=node.recoveries if node is not None else 0,
                   held_sends=node.held_sends if node is not None else 0,
                   steps_per_s=life.trained_steps / life.train_seconds if life.train_seconds > 0 else None)
        if self.metrics is not None and node is not None:
            self.metrics.write(json.dumps({"event": "summary", **out}, default=_jsonable) + "\n")
        return out
