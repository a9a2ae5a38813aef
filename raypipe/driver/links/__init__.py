"""The pipeline's links between neighbouring stages: which way each carries boundary values
(`ways`: NCCL between GPUs of their own, host memory otherwise), their rates measured at each
start (`measure`), a profiled plan made again for them (`replan`), and
after the first timed step, whether one bounds the step and what would shorten it (`advice`)."""
