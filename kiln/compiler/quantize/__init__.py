"""Quantization at compile time: calibration (``calibrate``), the accuracy budget (``budget``) and the
driver that runs a recipe's calibrated stages (``int8``)."""
