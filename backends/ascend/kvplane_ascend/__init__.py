"""kvplane-ascend: the kvplane backend for Huawei Ascend NPUs.

kvplane finds it through the entry point ``npu`` in the group ``kvplane.backends``
(``KVPLANE_DEVICE=npu``) and imports ``kvplane_ascend.plugin`` only when the backend is selected or listed.
``torch_npu`` is imported only by ``AscendBackend.probe()`` and the device primitives, never when this
package is imported.
"""
