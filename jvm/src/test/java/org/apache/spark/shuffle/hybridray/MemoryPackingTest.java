package org.apache.spark.shuffle.hybridray;

import static org.junit.jupiter.api.Assertions.assertArrayEquals;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertSame;
import static org.junit.jupiter.api.Assertions.assertThrows;

import java.io.IOException;
import java.util.Arrays;
import java.util.List;
import org.junit.jupiter.api.Test;

class MemoryPackingTest {
  private static String show(List<int[]> groups) {
    StringBuilder out = new StringBuilder();
    for (int[] g : groups) {
      out.append(Arrays.toString(g));
    }
    return out.toString();
  }

  @Test
  void smallSegmentsShareObjectsUpToTheBound() {
    assertEquals("[0, 1, 2][3]", show(MemoryPacking.groups(new int[] {10, 20, 30, 5}, 60)));
    assertEquals("[0, 1, 2, 3]", show(MemoryPacking.groups(new int[] {10, 20, 30, 5}, 65)));
  }

  @Test
  void aSegmentAboveTheBoundIsAlone() {
    assertEquals("[0][1][2, 3]", show(MemoryPacking.groups(new int[] {10, 100, 20, 30}, 60)));
    assertEquals("[0][1]", show(MemoryPacking.groups(new int[] {100, 100}, 60)));
  }

  @Test
  void packingOffOrNothingToPack() {
    assertEquals("[0][1][2]", show(MemoryPacking.groups(new int[] {1, 2, 3}, 0)));
    assertEquals("", show(MemoryPacking.groups(new int[0], 100)));
  }

  @Test
  void locationsRoundTrip() throws IOException {
    byte[] a = {1, 2, 3};
    byte[] b = {4, 5};
    byte[] object = MemoryPacking.concat(List.of(a, b));
    assertArrayEquals(new byte[] {1, 2, 3, 4, 5}, object);
    String base = "rO0ABXNy+/=";
    String la = MemoryPacking.location(base, 0, 3);
    String lb = MemoryPacking.location(base, 3, 2);
    assertEquals(base, MemoryPacking.objectLocation(la));
    assertEquals(base, MemoryPacking.objectLocation(lb));
    assertArrayEquals(a, MemoryPacking.segment(la, object));
    assertArrayEquals(b, MemoryPacking.segment(lb, object));
    // An unpacked segment's location is its object's, read whole (the format before packing).
    assertEquals(base, MemoryPacking.objectLocation(base));
    assertSame(object, MemoryPacking.segment(base, object));
  }

  @Test
  void aSliceOutsideItsObjectOrMalformedIsAnIoError() {
    byte[] object = new byte[4];
    assertThrows(IOException.class, () -> MemoryPacking.segment("x@2:3", object));
    assertThrows(IOException.class, () -> MemoryPacking.segment("x@-1:2", object));
    assertThrows(IOException.class, () -> MemoryPacking.segment("x@1", object));
    assertThrows(IOException.class, () -> MemoryPacking.segment("x@a:b", object));
  }
}
