"""Plug-ins: modules that attach to any compatible backbone by configuration.

A plug-in lives in its own file here and registers itself with
``@PLUGINS.register("name")``; the config's ``plugins:`` section enables it
(``plugins: {ral: {msra: true, ...}}``) and :class:`PluggedModel` wraps the
backbone with it.  See :mod:`prvrlab.models.plugins.base` for the contract.
"""
