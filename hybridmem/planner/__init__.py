"""``hybridmem plan``: a cluster's switches predicted from a config and two layouts, through the runtime's
own steps and memory plan (:mod:`.cluster`), host memory per node (:mod:`.host`), LoRA runs
(:mod:`.lora`), advice (:mod:`.advice`), accelerator figures (:mod:`.presets`) and the command
(:mod:`.command`)."""
