"""Deployments: what runs where.

* ``config``: :class:`~runtime.deploy.config.DeploymentConfig`, the settings of a
  deployment and the rank flags they imply;
* ``local``: :class:`~runtime.deploy.local.LocalDeployment`, the coordinator
  engine in this process and the ranks as child processes (or, with
  ``--ranks external``, ranks that connect from elsewhere);
* ``external``: :class:`~runtime.deploy.external.ExternalRanks`, ranks launched
  with ``torchrun`` on other machines (docs/deploy.md);
* ``launch``: starting rank and coordinator processes the way torchrun would;
* ``devices``: where the ranks run (``--device``), checked before any start.

Nothing here parses a command line: runtime/cli does, and builds these values.
"""
