"""The GRPO step: the schedule that drives one step (`schedule`: capture the prompt once, score
every member, replay each member's branch with the loss, the exact prompt backward, then finalize
and the optimizer), its phases over a capture (`replay`: scoring and serial replay, blockwise for
long responses; `routing_replay`: the engine's routing decisions replayed), scoring a file of
groups outside a step (`scoring`, tools/score.py) and held-out evaluation (`evaluate`). It takes
a `LongStrawConfig` and hands each phase its section. Imports: every wing below."""
