"""Suite-wide: the zero-code start-up hook (ds_muon/_autoload.py) stays off unless a test turns it on.

Where ds_muon is pip-installed into the test environment, its ``ds_muon_autoload.pth`` would enable
ds_muon in every process that imports deepspeed, and tests that build DeepSpeed's own optimizers, or
check that ``ds_muon.disable()`` restores DeepSpeed, would see ds_muon instead. Spawned ranks inherit
the variable. tests/test_autoload.py sets it per subprocess.
"""
import os

os.environ["DS_MUON"] = "0"
