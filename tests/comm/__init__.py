"""Tests of the communicators (`crossdevice._comm`): one contract for every one of them."""
