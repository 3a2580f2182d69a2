//! gpupool device plugin.
