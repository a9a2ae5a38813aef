"""Checkpoints as files: where they lie and which are complete (`layout`: the manifest, the run
that owns them, listing, pruning, verifying), how a stage's tensors are written and read back
(`files`), and where they are written (`storage`: local directories or pyarrow URIs such as
s3://, with secrets kept out of every message).

Saving and loading across the actors is the driver's part (`raypipe.driver.checkpoints`); each
actor's own share is `raypipe.actors.io.checkpoint_io`.
"""
