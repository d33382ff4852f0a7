"""The placement-group allocator: where every rank runs (layout, pure), placement groups on Ray, the cluster
shape a recipe needs, Megatron's parallel groups, network interfaces, typed actor groups and Ray auth.

It never imports engines, trainers or rollout code.
"""
