"""MONAI classification networks chosen by name, all usable with Opacus DP-SGD.

Three architectures (:data:`ARCHITECTURES`, name -> class), each a thin subclass of
:class:`FedweighNet` (:mod:`fedweigh.models.base`), as MONAI's ``DenseNet121`` is of its ``DenseNet``:

- ``densenet_compact`` (:class:`DenseNetCompactNet`) and ``densenet121`` (:class:`DenseNet121Net`):
  MONAI DenseNets (:mod:`fedweigh.models.densenet`);
- ``vit`` (:class:`ViTNet`): a Vision Transformer from MONAI's ``ViT`` encoder with a class token and a
  linear head (:mod:`fedweigh.models.vit`).

``build_model(arch, ...)`` and ``FedweighNet(arch=..., ...)`` build the architecture named; the
wrapper stores each constructor argument as an attribute of the same name, so NVFlare's Job API can
serialise and re-create it, and a job's persistor names the one class ``FedweighNet``. Every
activation is created with ``inplace=False`` (in-place ReLU breaks Opacus' backward hooks). Nothing is
downloaded: ``pretrained`` names a checkpoint file the user provides
(:mod:`fedweigh.models.checkpoints`: the network's weights from it, the classification head
re-initialised for the dataset's classes; a ViT takes its size from it).
"""

from fedweigh.models.base import ARCHITECTURES, DEFAULT_ARCH, NORMS, FedweighNet
from fedweigh.models.checkpoints import CHECKPOINT_STATE_KEYS, read_checkpoint
from fedweigh.models.densenet import DenseNet121Net, DenseNetCompactNet, densenet_min_input_size
from fedweigh.models.factory import build_model, count_parameters, make_opacus_compatible
from fedweigh.models.vit import VIT_HEAD_WIDTH, ViTNet, vit_dims_from_checkpoint, vit_patch_size

__all__ = [
    "ARCHITECTURES",
    "CHECKPOINT_STATE_KEYS",
    "DEFAULT_ARCH",
    "NORMS",
    "VIT_HEAD_WIDTH",
    "DenseNet121Net",
    "DenseNetCompactNet",
    "FedweighNet",
    "ViTNet",
    "build_model",
    "count_parameters",
    "densenet_min_input_size",
    "make_opacus_compatible",
    "read_checkpoint",
    "vit_dims_from_checkpoint",
    "vit_patch_size",
]
