"""Older spellings of the example trainers: ``python -m mmm.trainer.vit`` and ``mmm.trainer.fsdp``
run the same programs as ``mmm.examples.vit`` and ``mmm.examples.fsdp``."""
