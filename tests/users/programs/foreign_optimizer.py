"""The critic's optimizer passed with the policy: refused, naming the optimizer and what differs."""

import sys

import torch
from transformers import AutoModelForCausalLM

from hybridmem import ShardingManager
from hybridmem.engines import ReferenceEngine

policy = AutoModelForCausalLM.from_pretrained(sys.argv[1])
critic = AutoModelForCausalLM.from_pretrained(sys.argv[1])
critic_opt = torch.optim.AdamW(critic.parameters(), lr=1e-2)
ShardingManager(policy, ReferenceEngine(policy.config), optimizer=critic_opt)
print("accepted")
