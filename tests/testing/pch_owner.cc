// Owns the tests' precompiled header (tests/testing/pch.h): CMake builds it with this
// target's flags, and every test binary reuses it (cmake/FerryHelpers.cmake).
int main() { return 0; }
