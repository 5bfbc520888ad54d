"""Run observability: metrics files, TensorBoard, console progress (no megatron)."""
