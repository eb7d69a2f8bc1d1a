"""Build hook: ship ``ds_muon_autoload.pth`` into site-packages (ds_muon/_autoload.py says why).

Everything else about the package lives in pyproject.toml. The ``.pth`` file is copied to the root
of ``build_lib`` (for ``pip install .`` / wheels, whose root is site-packages) and, under
``pip install -e .`` (PEP 660), to the root of the editable wheel, which setuptools' editable_wheel
command hands to ``build_py`` as ``install.install_lib``.
"""
import os

from setuptools import setup
from setuptools.command.build_py import build_py as _build_py

PTH = "ds_muon_autoload.pth"


class build_py(_build_py):  # noqa: N801 (setuptools command name)
    def run(self):
        super().run()
        here = os.path.dirname(os.path.abspath(__file__))
        targets = [self.build_lib]
        if getattr(self, "editable_mode", False):
            targets.append(self.get_finalized_command("install").install_lib)
        for target in targets:
            self.mkpath(target)
            self.copy_file(os.path.join(here, PTH), os.path.join(target, PTH))

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": build_py})
