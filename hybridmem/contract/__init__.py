"""The contracts between the switch core and its parts: what an inference engine and a training state
must offer (:mod:`.engine`, :mod:`.training`), how they declare more (:mod:`.capabilities`), and the
categories memory is counted by (:mod:`.kinds`)."""
