"""keras-io's examples, ported small (issue 59 item 7): their models, custom layers, custom
`Model` subclasses, losses, metrics and `compile`/`fit` calls as keras-io publishes them (the
Keras 3 versions), on synthetic data of their shapes with row counts that divide neither the
batch size nor the replica count, trained by `Accelerator.fit` against plain Keras on one
device. This folder mirrors no package of keras_accel: one module per keras-io area
(`vision.py`, `nlp.py`, ...) holds the ports, `_port.py` their registry, and
`test_keras_io.py` the comparison."""
