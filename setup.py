"""Build hook: ship ``mindspeed_flow_autoload.pth`` into site-packages (the zero-edit path).

Everything else is declared in setup.cfg.  A ``.pth`` file must sit at the top of
site-packages, outside any package, so ``build_py`` copies it into the build tree root; a
wheel (``pip install .``) then installs it beside the package.  Editable installs
(``pip install -e .``) build their wheel through ``editable_wheel``, whose build tree is
not shipped, so that command copies the file into the wheel it unpacks (setuptools >= 64;
``_run_build_commands`` is the one step every version since has).
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH_FILE = "mindspeed_flow_autoload.pth"
PTH_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), PTH_FILE)


class BuildPyWithPth(build_py):
    """``build_py`` that also places the activation ``.pth`` file at the build root."""

    def run(self):
        super().run()
        self.copy_file(PTH_SOURCE, os.path.join(self.build_lib, PTH_FILE))

    def get_outputs(self, include_bytecode=1):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH_FILE)]


class EditableWheelWithPth(editable_wheel):
    """``editable_wheel`` that also puts the activation ``.pth`` file into the wheel."""

    def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):
        result = super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)
        self.copy_file(PTH_SOURCE, os.path.join(unpacked_wheel, PTH_FILE))
        return result


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
