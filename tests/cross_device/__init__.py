"""Tests of the cross-device ops layer (`crossdevice._cross_device`, `_collectives.algorithms`)."""
