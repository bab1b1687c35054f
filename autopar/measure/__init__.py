"""Measure, never decide: a capture's report against closed forms (``inspection``), layer and
collective timings on this hardware (``profile``, ``comm``), predicted against measured step
time (``calibrate``), and a plan's training against one process (``verify``)."""
