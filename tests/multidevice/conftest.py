"""Tests here need 8 devices: tests/test_multidevice.py runs them in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8 and JAXRL_MULTIDEVICE=1, so the rest of
the suite keeps one device."""
import os

if os.environ.get("JAXRL_MULTIDEVICE") != "1":
    collect_ignore_glob = ["test_*.py"]
