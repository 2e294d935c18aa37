"""kvplane-mlu: the kvplane backend for Cambricon MLUs.

kvplane finds it through the entry point ``mlu`` in the group ``kvplane.backends``
(``KVPLANE_DEVICE=mlu``) and imports ``kvplane_mlu.plugin`` only when the backend is selected or listed.
``torch_mlu`` is imported only by ``MluBackend.probe()`` and the device primitives, never when this
package is imported.
"""
