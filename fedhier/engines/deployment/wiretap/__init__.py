"""The wire-byte meter's folder: put it on ``PYTHONPATH`` to load its ``sitecustomize``.

This folder is a package only so that it ships in the wheel; its one module,
``sitecustomize.py``, is meant to be imported as the *top-level* module ``sitecustomize``,
which Python's ``site`` imports at startup when this folder is on ``sys.path``.
:func:`fedhier.engines.deployment.wire.wire_env` sets that up for a process and
:func:`fedhier.engines.deployment.wire.read_wire` sums what the processes wrote. Importing
``fedhier.engines.deployment.wiretap.sitecustomize`` as a submodule does nothing.

Keep this folder free of other modules: everything in it becomes importable top-level in
every process started with it on ``PYTHONPATH``.
"""
