"""Plain single-device models, one package per model with its recipes beside it (TP plan, shape
checks, context-parallel hook, checkpoint mapping); parallelism is applied from outside (mmm.parallel)."""
