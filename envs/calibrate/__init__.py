"""Calibration: fit the cost model's device figures to measured passes.

- :mod:`envs.calibrate.fit`: the fit itself (numpy only);
- :mod:`envs.calibrate.torch_passes`: times real passes of a random decoder (torch);
- :mod:`envs.calibrate.steps`: an engine's own measured steps as data;
- :mod:`envs.calibrate.vidur`: measured per-layer GPU operator times (Vidur's data) as
  data, and the fit of a GPU's figures to them (:mod:`envs.calibrate.vidur_report`: its
  error tables and plot);
- ``python -m envs.calibrate``: the command line.

Kept apart from the simulator's modules: only this package may import torch (lazily).
"""
