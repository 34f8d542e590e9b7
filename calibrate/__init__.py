"""Everything that touches torch: the live model, the live engine, calibration.

Import submodules explicitly (``calibrate.model``, ``calibrate.engine``); this
package itself imports nothing so that ``import calibrate`` stays cheap.
"""
