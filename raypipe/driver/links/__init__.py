"""The pipeline's links between neighbouring stages: which way each carries boundary values
(`ways`: NCCL between GPUs of their own, host memory otherwise), their rates measured at each
start (`measure`), a profiled plan made again for them (`replan`), and
after the first steps, whether one bounds the step, its boundaries narrowed for it (`boundary_dtype`
"auto") and what else would shorten it (`advice`)."""
