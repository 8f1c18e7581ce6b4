"""Programs compiled without the hardware: a run's arrays as abstract shapes (`abstract_arrays`),
each placement's bytes per device (`plan`) and the reader of compiled HLO text (`hlo`)."""
