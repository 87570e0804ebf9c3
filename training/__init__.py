"""What a training run needs besides ``train.py``'s task function, by concern:

- :mod:`training.settings`: the checks of a run's settings before training.
- :mod:`training.resume`: continuing an earlier run from its checkpoint (``resume=``).
- :mod:`training.signals`: Ctrl+C and SIGTERM during training.
- :mod:`training.sweep_stop`: stopping a ``hydra/launcher=joblib`` sweep without cutting its jobs' saves.
- :mod:`training.run_folders`: undoing what Hydra made for a refused run.

The modules import torch and Lightning: ``train.py`` imports them after it has installed its quiet
Ctrl+C handler (:func:`eval.startup.quiet_interrupt_while_starting`). Nothing in kernels/, mixers/,
models/, data/ or eval/ imports this package.
"""
