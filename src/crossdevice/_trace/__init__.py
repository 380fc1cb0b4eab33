"""Tracing: a bounded timeline, the straggler report and the flight recorder (issue #28).

* `state`: whether tracing is on, and the hooks the rendezvous, the runner and the worker
  sequencer call (only when it is);
* `recorder`: the bounded ring of events and its Chrome/Perfetto JSON writer;
* `session`: `trace(path)` and `CROSSDEVICE_TRACE`;
* `stragglers`: who keeps everyone waiting, logged every K steps;
* `flight`: the always-on flight recorder and its reports on failure (a worker
  communicator's part is rendered by `crossdevice._comm.workers.flight`);
* `merge` and `render`: one timeline from the workers' files, and a PNG of it.

The standard library only (matplotlib, lazily, for `render`): the synchronisation kernel
imports `state` and `flight`, so this package sits below it (tests/test_layers.py).
"""
