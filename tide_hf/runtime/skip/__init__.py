"""Skip mode: the layers after an exit are not computed.

`skipper` replaces the forwards of the layers that may be skipped and decides, per checkpoint, whether a step goes
on; `compaction` runs a layer on the rows and positions still running; `kv` keeps the cache of skipped layers sound
(`kv="propagate"`, `kv="recompute"`); `probe` checks propagate's K/V at attach; `segments` is the compiled path
(one graph per segment of layers between checkpoints). Import the modules themselves: this file re-exports nothing,
so `session.py` may import a part without loading the rest.
"""
