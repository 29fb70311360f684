"""sitsmesh: the control plane beside Envoy/Istio in front of inference pipelines."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("sitsmesh")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+src"

__all__ = ["__version__"]
