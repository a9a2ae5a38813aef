"""The pipeline's links between neighbouring stages: which way each carries boundary values
(`ways`: NCCL between GPUs of their own, host memory otherwise), their rates measured at each
start (`measure`), and a profiled plan made again for them (`replan`)."""
