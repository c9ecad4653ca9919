"""Operator tools: the ``kvguard`` command (:mod:`cli`) and its subcommands, one file per
single-file command, one folder per command of several files (``ab/``, ``plan/``)."""
