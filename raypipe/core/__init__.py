"""The ground every other package stands on, importing nothing of raypipe above it: the errors a
user sees (`errors`), the environment's switches (`env`), accelerators and where actors may run
(`devices`), how a model is described layer by layer (`layers`), what the driver and the actors
tell each other (`protocol`), and the third-party notices kept out of every run's output
(`notices`)."""
