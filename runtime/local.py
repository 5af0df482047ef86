"""The Python API's name for a deployment on one machine::

    from runtime.local import LocalDeployment

    with LocalDeployment(tensor_parallel_size=2) as deployment:
        ...

It lives in runtime/deploy/local.py; its settings are
:class:`runtime.deploy.config.DeploymentConfig`.
"""

from runtime.deploy.local import LocalDeployment

__all__ = ["LocalDeployment"]
