"""Parallelism over a named DeviceMesh.

``from mmm.parallel import init_mesh`` is light: it needs only torch's DeviceMesh.
Heavy optional packages (deepspeed, ...) load only inside the helpers that use them.
"""

from mmm.parallel.mesh import AXES, FLAT_VIEWS, Mesh, MeshError, ParallelDims, check_degrees, init_mesh
from mmm.parallel.report import describe_sharding

__all__ = ["AXES", "FLAT_VIEWS", "Mesh", "MeshError", "ParallelDims", "check_degrees", "describe_sharding",
           "init_mesh"]
