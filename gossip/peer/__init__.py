"""The wall-clock driver of one member: sockets, threads, signals, reports; the user-loop integration."""
