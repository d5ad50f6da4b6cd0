"""hvrep: write the training step for one replica, run it on many."""

import re
from pathlib import Path

from setuptools import find_packages, setup

_HERE = Path(__file__).parent
VERSION = re.search(r'__version__ = "([^"]+)"', (_HERE / "hvrep" / "_version.py").read_text()).group(1)

setup(
    name="hvrep",
    version=VERSION,
    description="Replicated training on Horovod (MPI/Gloo/NCCL), TPU or one machine, for TensorFlow 2",
    long_description=(_HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11,<3.12",
    packages=find_packages(include=["hvrep", "hvrep.*"]),
    # The compat headers and the shim source are data the Horovod build reads.
    package_data={"hvrep.compat": ["README.md", "stream_shim.cc", "include/**/*.h", "include/**/**/*.h"]},
    include_package_data=True,
    # Ranges, not pins: `make setup` installs the exact pins of requirements.txt.
    # Horovod is absent on purpose: it is built from source against this
    # TensorFlow by `python -m hvrep.compat.build_horovod` (see README.md).
    install_requires=[
        "numpy>=1.26",
        "mpi4py>=4.0",
        "tqdm>=4.60",
        "python-hostlist>=2.0",
        "psutil>=5.9",
        "cloudpickle>=2.0",
        "pyyaml>=6.0",
        "packaging>=23",
    ],
    extras_require={
        "cpu": ["tensorflow-cpu>=2.21,<2.22"],
        "gpu": ["tensorflow[and-cuda]>=2.21,<2.22"],
        "dali": ["nvidia-dali-cuda120>=2.4"],
        "demo": ["scikit-learn>=1.3", "pillow>=10"],
    },
    entry_points={"console_scripts": ["hvrep=hvrep.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3.11",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
