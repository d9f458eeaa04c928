"""Training: the LoRA trainer (`trainer.py`: step(groups) -> version + 1), a step's groups as token batches
(`batch.py`, packed with each group's prompt once in `packing.py`), the policy loss and its presets (`loss.py`),
base models (`models.py`, published shapes in `shapes/`, folders written whole in `folders.py`) and the memory plan
of one device made from config.json alone (`plan.py`; the run plans each device for what its placement puts
on it: `minirl.run.plan`)."""
