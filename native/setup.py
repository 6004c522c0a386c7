"""Builds JustFit's native kernels against the installed MLX (MLX's extension mechanism:
CMake + nanobind in MLX's domain). `./dev setup` runs it; see native/README.md."""

from mlx import extension
from setuptools import setup

setup(
    name="justfit-native",
    version="0.1.0",
    description="JustFit's native CPU kernels for MLX",
    ext_modules=[extension.CMakeExtension("justfit_native._ext", sourcedir=".")],
    cmdclass={"build_ext": extension.CMakeBuild},
    packages=["justfit_native"],
    zip_safe=False,
    python_requires=">=3.11",
)
