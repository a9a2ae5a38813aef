"""A stage's optimizer side: the optimizer, its learning rate and fp16 loss scale built from the
config's specs (`build`), where they are stepped with clipping and the dp average (`optimizer`),
ZeRO-1 shares (`zero`) and ZeRO-3 slices (`zero3`), and keeping torch's compiler out of an actor
that compiles nothing (`lazy_dynamo`)."""
