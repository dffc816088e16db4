"""Model math shared by hybridmem's own engine and example trainer (RMSNorm, RoPE, SwiGLU, TP collectives)."""
