"""Build hook: ship ``vime_gemma4_bridge_autoload.pth`` at the root of site-packages.

The ``.pth`` line is inert unless ``VIME_GEMMA4_BRIDGE_AUTOLOAD=1`` (see vime_gemma4_bridge/compat/autoload.py).
Everything else about the distribution is declared in pyproject.toml.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "vime_gemma4_bridge_autoload.pth"


class BuildPyWithAutoload(build_py):
    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / PTH
        target.write_text(Path(__file__).with_name(PTH).read_text())

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH)]


setup(cmdclass={"build_py": BuildPyWithAutoload})
