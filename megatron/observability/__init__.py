"""What a run reports about itself: the training logger (console, metrics.jsonl, TensorBoard, W&B, Comet,
DeepSpeed monitors), FLOPs per token / TFLOP/s / MFU with one formula (flops), DeepSpeed's communication
summary (comms_logging) and the named timers (timers).

May import: megatron.errors, utils, mpu, model.
"""
