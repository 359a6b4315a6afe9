"""The trainwatch tab in TensorBoard: alerts and per-layer gradient norms at a glance.

Kept import-light on purpose: the sink imports ``metadata`` while training,
and only TensorBoard itself imports ``loader`` and ``plugin`` (werkzeug & co).
"""
