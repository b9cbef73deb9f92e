"""Performance model and memory planner for the 4D (X, Y, Z tensor + data) grid.

Imports only the standard library, numpy and yaml; torch only for the `local` calibration.
"""
from axonn.plan.calibrate import get_hardware
from axonn.plan.choose import Inference, Train, choose_grid
from axonn.plan.collectives import collective_time, ring_time, wire_bytes
from axonn.plan.hardware import PRESETS, Hardware
from axonn.plan.model import Prediction, model_flops, predict
from axonn.plan.search import plan, valid_grids
from axonn.plan.shapes import ModelShape, load_shape
from axonn.plan.volumes import Grid, collective_volumes

__all__ = [
    "Grid", "Hardware", "Inference", "ModelShape", "PRESETS", "Prediction", "Train", "choose_grid",
    "collective_time",
    "collective_volumes", "get_hardware", "load_shape", "model_flops", "plan", "predict",
    "ring_time", "valid_grids", "wire_bytes",
]
