"""The shared vocabulary: messages, flat state, buffers, checkpoints, the actions programs yield."""
