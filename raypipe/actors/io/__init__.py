"""What a stage reads and writes: its share of a checkpoint, the replicas' weights a recovery
takes from survivors' memory, and the actor that reads a dataset's batches beside the stages."""
