"""Operations: the CLI, the control socket, the supervised launcher, metrics, KV events, logs."""
