package org.apache.spark.shuffle.hybridray;

import static org.junit.jupiter.api.Assertions.assertArrayEquals;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;

import java.io.ByteArrayInputStream;
import java.io.IOException;
import java.io.InputStream;
import java.io.SequenceInputStream;
import java.io.UncheckedIOException;
import java.util.ArrayList;
import java.util.List;
import org.junit.jupiter.api.Test;

class LazySegmentsTest {
  @Test
  void aBlockIsFetchedOneSegmentAtATimeAsItIsRead() throws IOException {
    List<Integer> opened = new ArrayList<>();
    int segments = 64;
    InputStream block = new SequenceInputStream(new LazySegments(segments, i -> {
      opened.add(i);
      return new ByteArrayInputStream(new byte[] {(byte) i, (byte) i});
    }));
    assertEquals(List.of(0), opened);  // nothing but the first before the first read
    byte[] all = new byte[2 * segments];
    for (int i = 0; i < segments; i++) {
      assertEquals(2, block.readNBytes(all, 2 * i, 2));
      assertEquals(i + 1, opened.size(), "segments ahead of the reader were fetched");
    }
    assertEquals(-1, block.read());
    byte[] expected = new byte[2 * segments];
    for (int i = 0; i < expected.length; i++) {
      expected[i] = (byte) (i / 2);
    }
    assertArrayEquals(expected, all);
  }

  @Test
  void aSegmentThatFailsFailsTheReadWhereItIsReached() {
    InputStream block = new SequenceInputStream(new LazySegments(3, i -> {
      if (i == 2) {
        throw new UncheckedIOException(new IOException("segment 2 is gone"));
      }
      return new ByteArrayInputStream(new byte[] {1});
    }));
    assertThrows(UncheckedIOException.class, () -> block.readAllBytes());
  }
}
