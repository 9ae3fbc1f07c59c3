"""C++ kernels for the CPU (chapter 7's appendix): how they are built and loaded."""
