"""The trained pipeline without a step: forward passes (`forward`: evaluate, predict) and
token generation with a KV cache (`generation`)."""
